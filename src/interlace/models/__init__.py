"""Reference models: a GPT-2 style decoder, dense or Mixture-of-Experts (`gpt`), its config
(`config`), feed-forward (`mlp`) and named presets (`presets`). Import from the modules
themselves; `interlace` re-exports `GPT`, `GPTConfig`, `build_model` and `get_preset`."""
