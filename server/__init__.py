"""HTTP frontend and the `pagedserve` command line."""
