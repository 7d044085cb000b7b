"""The OpenAI-compatible HTTP server on the AsyncEngine (``omniloop serve``).

``omniloop.serve.app.create_app(engine, config)`` builds the FastAPI app;
``omniloop.serve.server.run_server`` runs it with uvicorn and drains on SIGTERM.
Nothing is imported here, so subpackages (e.g. ``serve.dynamo``) need no web stack.
"""
