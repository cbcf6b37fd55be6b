"""Rendering for people: Jinja2 templates, charts and pictures of the reports."""
