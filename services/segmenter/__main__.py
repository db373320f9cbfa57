from services.segmenter.main import main

raise SystemExit(main())
