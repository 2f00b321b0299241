"""OpenAI's Assistants API: assistants, threads, messages and runs over the app's database."""

# The route modules in the order they are matched: `POST /v1/threads/runs` (run_routes)
# must come before `POST /v1/threads/{thread_id}` (routes).
ROUTE_MODULES = ("run_routes", "routes")
