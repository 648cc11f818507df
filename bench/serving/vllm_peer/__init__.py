"""The vLLM peer of bench_vs_vllm: the checkpoint both sides serve, and setup.sh for its own venv."""
