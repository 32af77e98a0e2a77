"""The rollout inspector: `python -m vime.inspect OUTPUT_DIR` writes OUTPUT_DIR/inspect/index.html and one static
page per saved rollout (`vime.inspect.load` reads, `vime.inspect.render` writes HTML)."""
