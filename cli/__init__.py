"""logctl, the operator's command line."""
