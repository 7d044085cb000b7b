"""Built-in cache-acceleration interceptors: DBCache/FBCache, TaylorSeer, TeaCache."""
