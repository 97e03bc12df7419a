"""Helpers the tests share (tests/conftest.py puts tests/ on sys.path, so a test imports
`from support.synth import write_gguf` or `from support import synth`):

    synth              synthetic GGUF files and Hugging Face directories
    real_models        the real models of the slow tests, fetched once into a cache
    hf_oracle          tiny random models made by transformers and converted by llama.cpp
    moe_models         the GPU tests' tiny qwen3moe models (also a script: python tests/support/moe_models.py DIR)
    thinking_model     a tiny random qwen3 whose chat template thinks
    gguf_kv            a GGUF file's key/value section as an editable list
    metadata_fuzz      mutants of a real GGUF header (also run by tools/fuzz_metadata.py)
    tokenizer_corpus   hard text and the tokenizers under test
    hostile_templates  chat templates that run away on demand
    tool_defs          the tools the tool-calling tests offer
    paging             block tables for tests that drive a backend directly
    pipeline_rows      sample rows for the pipelined-sampling tests
    flash_cases        paged-attention cases and their float64 oracle
    parity             the GPU tests' logits cosines against the NumPy oracle, and ParityRun, their parity loop
    split16_twin       the NumPy twin of the split16 prefill GEMM
    q8                 the NumPy twin of the 8-bit activations (mmv8.cu, mmq.cu's 8-bit variant)
    host_emu           builds the host emulators of tests/host/ with g++ and runs their launches
    grammars           grammars too large or too slow for a request
    server             a real `bentoml serve` process (the `server` fixture's; a module's own: model_server,
                       tiny_model_server) and guided_chat, a grammar-held chat completion
    pool_child         a child process for ChildPool's tests (a child imports it as tests.support.pool_child)
    devices            the opt-in shared memory a block of each planned-for compute capability may hold
"""
