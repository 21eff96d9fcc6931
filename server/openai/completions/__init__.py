"""`POST /v1/completions`: request and response models (`protocol`) and serving (`serving`)."""
