"""Export a training checkpoint to another framework's format (`interlace export`):
`full_state.py` reads the whole model from a checkpoint of any split on one process,
`gpt2.py` maps the built-in GPT onto Hugging Face GPT-2, `hf_folder.py` writes the folder."""
