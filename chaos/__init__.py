"""Live fault injection: throwaway services, process kills, the scenario runner and CLI."""
