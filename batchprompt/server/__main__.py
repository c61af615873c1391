"""python -m batchprompt.server [--model M] [--host H] [--port P] [--api-key K] ..."""
from .command import main

raise SystemExit(main())
