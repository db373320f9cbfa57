from versions.compare import compare, parse
