"""Rendering records for people: Jinja2 templates, charts, pictures."""
