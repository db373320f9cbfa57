from nest.flat import flatten
