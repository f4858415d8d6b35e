"""DMuon runtime: owned parameters, boundary groups, collectives, hooks and state."""
