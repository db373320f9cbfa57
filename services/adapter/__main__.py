from services.adapter.main import main

raise SystemExit(main())
