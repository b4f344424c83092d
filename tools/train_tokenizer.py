from megatron_boost.cli.train_tokenizer import main
if __name__ == "__main__":
    raise SystemExit(main())
