"""Model definitions on speedcore's ops (one Llama-family file with per-family switches)."""
