from stats.center import median
