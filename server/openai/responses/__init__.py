"""The Responses API (`/v1/responses`): request models (`protocol`), a request as the chat request
it runs as (`inputs`), output items and stream events (`output`), serving (`serving`), and the
stores that keep responses for later requests (`store`)."""
