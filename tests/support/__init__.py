"""What the tests share (never import one test module from another), one module per purpose: models (tiny
models and tokenizers), exact (running the loop, exact distributions and the distribution test), broken (deliberately
broken rules and drafters, the controls that must fail), fakes (a scripted Session for fast UI tests), gguf (tiny GGUF
files), process (a fresh specchat process), remote_standin (a stand-in llama-server). tests/ is on sys.path
(pyproject.toml's pythonpath), so any test imports them as `from support.models import tiny_llama`."""
