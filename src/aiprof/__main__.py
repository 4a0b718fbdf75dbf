from aiprof.cli.main import main

raise SystemExit(main())
