"""Loading: official yaml (`yaml_config`) and checkpoints (`checkpoint`, strict), and the model loader
(`loader.load_model`: an official model dir, or a preset in `presets/` with seeded dummy weights)."""
