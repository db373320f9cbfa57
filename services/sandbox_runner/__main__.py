from services.sandbox_runner.main import main

raise SystemExit(main())
