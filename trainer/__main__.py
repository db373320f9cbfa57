from trainer.main import main

raise SystemExit(main())
