"""The HTTP request path inside an ingress replica: the FastAPI app, its guard and error
mapping, one request's generation from replica deltas to text, and streaming it out."""
