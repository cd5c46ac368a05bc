"""Export a training checkpoint to another framework's format (`interlace export`):
`full_state.py` reads the whole model from a checkpoint of any split on one process,
`gpt2.py` and `llama.py` map the built-in GPT onto Hugging Face GPT-2 and Llama (one
`check_expressible`, `hf_config`, `hf_state` each; `shape.py` the shape check they share),
`hf_folder.py` writes the folder."""
