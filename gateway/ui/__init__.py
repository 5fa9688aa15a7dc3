"""The live page (`/ui`): its route, its stats and its static files."""
