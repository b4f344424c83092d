from megatron_boost.cli.layer_ops import main
if __name__ == "__main__":
    raise SystemExit(main())
