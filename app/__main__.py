from dcpstudio.cli.main import main

raise SystemExit(main())
