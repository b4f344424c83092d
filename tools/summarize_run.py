from megatron_boost.cli.summarize_run import main
if __name__ == "__main__":
    raise SystemExit(main())
