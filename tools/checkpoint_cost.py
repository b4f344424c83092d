from megatron_boost.cli.checkpoint_cost import main
if __name__ == "__main__":
    raise SystemExit(main())
