from services.grader.main import main

raise SystemExit(main())
