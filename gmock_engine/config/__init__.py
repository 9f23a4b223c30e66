"""Configuration: every option declared once, the loader (command line > environment > file > default), the typed settings, and what a reload changes. Pure."""
