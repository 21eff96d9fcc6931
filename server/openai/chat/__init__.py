"""`POST /v1/chat/completions`: request and response models (`protocol`), what the request's tools
ask (`tool_choice`), the shaping of a choice's text into reasoning, content and tool calls
(`output`), and serving (`serving`)."""
