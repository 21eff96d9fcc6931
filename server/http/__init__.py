"""What every API's routes share on the way in and out: admission of generating requests, the
API key, the body size limit, and SSE streaming."""
