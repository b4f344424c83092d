from megatron_boost.cli.paper_table import main
if __name__ == "__main__":
    raise SystemExit(main())
