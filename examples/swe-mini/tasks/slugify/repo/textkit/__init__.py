from textkit.slug import slugify
