from dcpstudio.cli import main

raise SystemExit(main())
