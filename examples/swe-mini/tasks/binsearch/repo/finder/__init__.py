from finder.search import find
