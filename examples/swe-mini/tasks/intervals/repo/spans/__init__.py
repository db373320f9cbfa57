from spans.merge import merge
