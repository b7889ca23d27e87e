"""python -m metrale_gateway --worker HOST:PORT [--worker HOST:PORT ...] [--port 8000]: the OpenAI-compatible front
over the workers."""

import argparse

import uvicorn

from metrale_gateway.openai_front import create_app


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="append", required=True, help="a worker's gRPC address (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-name", default=None, help="the model's name in the API (default: the worker's)")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="prompt tokens a step sends at most")
    args = parser.parse_args(argv)
    uvicorn.run(create_app(args.worker, args.model_name, args.chunk_tokens), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
