"""Live fault injection: throwaway services, process kills, the scenario runner and CLI."""

import os as _os

# the compiled checker, before any of its modules is imported (`chaos.compiled`)
if _os.environ.get("CHAOS_COMPILED_BUILD") or _os.environ.get("CHAOS_COMPILED") == "1":
    from chaos.compiled import at_import as _at_import

    _at_import()
