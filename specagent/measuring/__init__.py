"""The measuring and tuning tools, apart from what a call passes through: ``bench`` (single
prompts beside the baselines a user would pick instead), ``agent_bench`` (agent episodes),
``divergence`` (a bf16 tie told from a real difference), ``evaluation`` (relaxed policies against
their lossless twins) and ``tuning`` (a relaxed policy's fastest settings within a quality
budget). Nothing in the runtime, the server or the call layer imports them."""
