"""realizar-backend: serve GGUF and safetensors language models through BentoML."""

__version__ = "0.1.0"
