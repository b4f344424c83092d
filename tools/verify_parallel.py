from megatron_boost.cli.verify_parallel import main
if __name__ == "__main__":
    raise SystemExit(main())
