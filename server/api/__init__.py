"""The HTTP side: the app, its routes, the serving logic and wire models of each endpoint family."""
