"""MkDocs hook (mkdocs.yml, `hooks:`): heading anchors as GitHub writes them, so that a link written for
GitHub — `page.md#a-heading`, checked by tests/test_docs_links.py — lands on the same heading of the site.

Python-Markdown's own slug drops non-ASCII letters (π, μ) and folds runs of '-' into one; GitHub keeps both.
"""


def gfm_slug(value: str, separator: str = "-") -> str:
    text = value.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "-_ ")
    return text.replace(" ", separator)


def on_config(config):
    config["mdx_configs"].setdefault("toc", {})["slugify"] = gfm_slug
    return config
