from rollbus.cli import main

raise SystemExit(main())
