"""The configuration, torch-free: schema, checks, spec grammars, argparse machinery."""
