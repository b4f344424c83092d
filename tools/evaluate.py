from megatron_boost.cli.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())
