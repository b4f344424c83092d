from megatron_boost.cli.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
